"""Launched by tests/test_distributed.py under torchrun (1 or 2 processes, gloo on CPU): tiny target,
answers, feature shards extracted by rank into WORK, an eagle3 head trained with train_eagle; rank 0
writes the loss history to OUT.

usage: torchrun --nproc-per-node N tests/ddp_train_probe.py WORK OUT STEPS [MAX_SECONDS]
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import loaded, tiny_llama  # noqa: E402
from verispec.drafters.eagle import EagleHead  # noqa: E402
from verispec.engine import Engine  # noqa: E402
from verispec.train import distributed  # noqa: E402
from verispec.train.extract import FeatureSet, extract_features  # noqa: E402
from verispec.train.loops import train_eagle  # noqa: E402
from verispec.train.vocab import build_draft_vocab  # noqa: E402
from verispec.types import SamplingParams  # noqa: E402

work, out, steps = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
max_seconds = float(sys.argv[4]) if len(sys.argv) > 4 else None
torch.set_num_threads(1)
distributed.init("cpu")
V = 40
tiny = loaded(tiny_llama(vocab=V, seed=11, layers=4))
plain = Engine.for_model(tiny, None, backend="hf")
g = torch.Generator().manual_seed(0)
records = []
for i in range(12):
    prompt = torch.randint(1, V, (int(torch.randint(3, 10, (1,), generator=g)),), generator=g).tolist()
    records.append({"id": str(i), "source": "t", "prompt_ids": prompt,
                    "answer_ids": plain.generate(prompt, SamplingParams(max_new_tokens=30)).token_ids})
L = tiny.model.config.num_hidden_layers
layers = [1, 2, 3, L]
paths = extract_features(tiny, records, work / "features", layers, shard_size=3, progress=False,
                         part=(distributed.rank(), distributed.world()))
distributed.barrier()
data = FeatureSet(paths)
torch.manual_seed(0)
d2t = build_draft_vocab(records, 24, V)
head = EagleHead(EagleHead.make_config(tiny, d2t.numel(), feature_layers=[1, 2, 3], layout="eagle3"))
head.d2t.copy_(d2t)
head.attach_embedding(tiny.model.get_input_embeddings().weight)
hist = train_eagle(head, data, V, work / "state", steps=steps, batch_size=4, seq_len=16, lr=3e-3, ttt_steps=2,
                   autocast="float32",  # bf16 rounding depends on how the rows split across ranks
                   log=lambda m: None, progress=False, save_every=4, max_seconds=max_seconds)
if distributed.is_main():
    out.write_text(json.dumps({"world": distributed.world(), "history": hist,
                               "fc": head.fc.weight.detach().flatten()[:16].tolist()}))
distributed.close()
