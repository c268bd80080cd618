"""Step-1 loss of the demo config on one process.

upcast=True: the fp32 cross-entropy; False: the bf16 one the trainer logs.
"""

import torch

from moeforge.config import load_config
from moeforge.train.losses import lm_loss_fn, moe_aux_terms
from moeforge.train.trainer import Trainer

cfg = load_config("configs/shakespeare.yaml", ["--train.run_dir=/tmp/step1_run", "--logging.progress=false"])
t = Trainer(cfg)
mbs = t.loader.next_step()
tot = 0.0
with torch.no_grad():
    for b in mbs:
        with t._autocast():
            logits = t.model(b[:, :-1])
        lm = lm_loss_fn(logits, b[:, 1:], upcast=True)
        w, _, _ = moe_aux_terms(t.model)
        tot += float(lm + w) / len(mbs)
print("STEP1_LOSS", tot, "vocab", cfg.model.vocab_size, [tuple(b.shape) for b in mbs], int(mbs[0][0, :5].sum()))
t.close()
