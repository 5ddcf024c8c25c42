"""The tiny character-level GPT recipe the monitors are demonstrated on: ``recipe`` (its
settings, no torch), ``corpus`` (the built-in texts), ``data`` (batches), ``model`` (the GPT),
``module`` (its LightningModule), ``train`` (the fit with the monitors), ``progress`` (progress
lines where the output is no terminal) and ``checkpoint`` (safe checkpoint loading)."""

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
