"""Typed errors a user can cause. Each message says what to do about it."""


class KVServeError(Exception):
    """Base class of every error kvserve raises on purpose."""


class ModelNotFoundError(KVServeError):
    """The model argument is neither a registered name, a .gguf file nor a Hugging Face folder."""


class ModelFetchError(KVServeError):
    """Fetching a registered model failed or produced a file that does not check out."""


class UnsupportedModelError(KVServeError):
    """The model file is readable but describes an architecture or layout kvserve cannot run."""


class UnsupportedTensorTypeError(UnsupportedModelError):
    """A tensor is stored in a quantization type kvserve cannot dequantize."""
