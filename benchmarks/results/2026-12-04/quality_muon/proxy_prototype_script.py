"""Experiment: the 1-process demo with Muon on the hidden matrices (LocalStack patched)."""
import sys
from torch import nn
import moeforge.parallel.parallelize as par
from moeforge.parallel.stack import LocalStack
from moeforge.model.params import named_parameter_roles, EXPERT, NO_DECAY
from moeforge.model.moe.router import TopKRouter
from moeforge.train.muon import MuonAdamW
from moeforge.cli import entry

def muon_groups(model: nn.Module, wd: float):
    routers = {id(m.weight) for m in model.modules() if isinstance(m, TopKRouter)}
    head = getattr(model, "lm_head", None)
    head_ids = {id(head.weight)} if head is not None else set()
    muon, muon_split, adam_decay, adam_no = [], [], [], []
    for name, p, role in named_parameter_roles(model):
        if role == NO_DECAY:
            adam_no.append(p)
        elif id(p) in routers or id(p) in head_ids:
            adam_decay.append(p)
        elif role == EXPERT and name.endswith("w1"):
            muon_split.append(p)
        else:
            muon.append(p)
    return [
        {"params": muon, "weight_decay": wd, "muon": True},
        {"params": muon_split, "weight_decay": wd, "muon": True, "split": 2},
        {"params": adam_decay, "weight_decay": wd},
        {"params": adam_no, "weight_decay": 0.0},
    ]

class MuonStack(LocalStack):
    def __init__(self, model, cfg):
        self.model = model
        o = cfg.optim
        groups = muon_groups(model, o.weight_decay)
        for g in groups:
            g["lr"] = o.lr
        self.optimizer = MuonAdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
        print("muon groups", [len(g["params"]) for g in groups], file=sys.stderr)
    def optimizer_state_dict(self, stage=None):
        return {}

par.LocalStack = MuonStack
entry()
