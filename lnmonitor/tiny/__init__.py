"""The tiny character-level GPT recipe the monitors are demonstrated on."""

from lnmonitor.tiny.data import CharDataModule, CharVocab, load_corpus
from lnmonitor.tiny.model import GPTConfig, TinyGPT
from lnmonitor.tiny.module import TinyGPTModule

__all__ = ["CharDataModule", "CharVocab", "GPTConfig", "TinyGPT", "TinyGPTModule", "load_corpus"]
