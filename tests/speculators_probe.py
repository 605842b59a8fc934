"""Runs inside the speculators environment (tests/speculators_env.py), never imports verispec: loads an
exported head with speculators' own Eagle3DraftModel, runs the library's forward on given features and
tokens, and saves the draft logits of every step (captured at its lm_head) and the library's own save.

usage: python speculators_probe.py HEAD_DIR INPUTS.pt OUT.pt SAVE_DIR
"""

import sys

import torch
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

head, inputs, out, save = sys.argv[1:5]
torch.set_num_threads(1)
config = Eagle3SpeculatorConfig.from_pretrained(head)
config.transformer_layer_config._attn_implementation = "eager"  # flex attention needs a compiler on CPU
model = Eagle3DraftModel.from_pretrained(head, config=config).float().eval()
data = torch.load(inputs)
logits = []
model.lm_head.register_forward_hook(lambda module, args, result: logits.append(result.detach().clone()))
with torch.no_grad():
    T = data["ids"].shape[1]
    model(hidden_states=data["features"], input_ids=data["ids"], document_ids=torch.zeros(1, T, dtype=torch.long),
          ttt_steps=int(data["steps"]))
torch.save({"logits": logits, "d2t": model.d2t.clone(), "t2d": model.t2d.clone(),
            "class": type(model).__module__ + "." + type(model).__name__}, out)
model.save_pretrained(save)
