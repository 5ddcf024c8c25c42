"""The tiny character-level GPT recipe the monitors are demonstrated on."""

from lnmonitor import _lazy_attributes

__all__ = ["CharDataModule", "CharVocab", "GPTConfig", "Recipe", "TinyGPT", "TinyGPTModule", "load_corpus"]

# Lazy, so that the command line can read the recipe and the corpus without torch.
__getattr__ = _lazy_attributes(__name__, {
    "CharDataModule": "lnmonitor.tiny.data",
    "CharVocab": "lnmonitor.tiny.data",
    "GPTConfig": "lnmonitor.tiny.model",
    "TinyGPT": "lnmonitor.tiny.model",
    "TinyGPTModule": "lnmonitor.tiny.module",
    "Recipe": "lnmonitor.tiny.recipe",
    "load_corpus": "lnmonitor.tiny.corpus",
})
