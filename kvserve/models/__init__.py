"""One file per architecture family. `MODEL_CLASSES` maps ModelConfig.architecture to the class."""

from kvserve.models.llama import LlamaForCausalLM

MODEL_CLASSES = {"llama": LlamaForCausalLM}
