"""Write tests/data/peft-tiny-llama3: a LoRA adapter saved by PEFT itself for the tiny Llama fixture, with the logits
PEFT's model computes for a greedy continuation (reference.npz), so that the LoRA tests read a file PEFT wrote and
compare against PEFT's numbers without torch.

Needs torch, transformers and peft (not the station's dependencies): python scripts/make_peft_adapter.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaForCausalLM

ROOT = Path(__file__).resolve().parent.parent
BASE = ROOT / "tests" / "fixtures" / "tiny-llama3"
OUT = ROOT / "tests" / "data" / "peft-tiny-llama3"
PROMPT = [1, 17, 99, 3, 250, 42, 42, 7, 128, 64, 5, 200, 31]
NEW = 8


def main() -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(BASE, torch_dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, use_rslora=True, init_lora_weights=False, lora_dropout=0.0,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    peft_model = get_peft_model(model, config).eval()
    with torch.no_grad():  # PEFT's random init gives B small values: make the adapter change the output
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(20.0)
        out = peft_model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False, output_logits=True,
                                  return_dict_in_generate=True, pad_token_id=0)
    peft_model.save_pretrained(OUT)
    tokens = out.sequences[0, len(PROMPT):].numpy().astype(np.int32)
    logits = torch.stack(out.logits, 0)[:, 0].numpy().astype(np.float32)
    np.savez(OUT / "reference.npz", prompt=np.array(PROMPT, np.int32), tokens=tokens, logits=logits)
    print(f"wrote {OUT}: tokens {tokens.tolist()}")


if __name__ == "__main__":
    main()
