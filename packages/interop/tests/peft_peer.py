"""The transformers + peft side of test_peft.py, run by an interpreter that has torch
(`JAXLEARN_TORCH_PYTHON`); the test environment has none.

    python peft_peer.py load BASE_DIR ADAPTER_DIR OUT.npy IDS_JSON
        PeftModel.from_pretrained(AutoModelForCausalLM(BASE_DIR), ADAPTER_DIR): logits
    python peft_peer.py create BASE_DIR ADAPTER_DIR OUT.npy IDS_JSON LORA_CONFIG_JSON
        get_peft_model(AutoModelForCausalLM(BASE_DIR), LoraConfig(**LORA_CONFIG_JSON)) with
        random A and B (init_lora_weights=False), saved to ADAPTER_DIR: logits

Logits are float32 [batch, tokens, vocab], saved with numpy.
"""

import json
import sys

import numpy as np
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM


def main() -> None:
    mode, base, adapter, out, ids = sys.argv[1:6]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32,
                                                 attn_implementation="eager")
    if mode == "load":
        model = PeftModel.from_pretrained(model, adapter)
    elif mode == "create":
        options = json.loads(sys.argv[6])
        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", init_lora_weights=False,
                                                 **options))
        model.save_pretrained(adapter)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(json.loads(ids))).logits
    np.save(out, logits.float().numpy())


if __name__ == "__main__":
    main()
