"""The model code: one decoder (`decoder.py`) whose families' differences are named in `config.py`.
`MODEL_CLASSES` maps ModelConfig.architecture to the class."""

from kvserve.models.config import SUPPORTED_ARCHITECTURES
from kvserve.models.decoder import DecoderForCausalLM

MODEL_CLASSES = dict.fromkeys(SUPPORTED_ARCHITECTURES, DecoderForCausalLM)
