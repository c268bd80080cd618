"""Mixture-of-experts feed-forward: router, experts, dispatchers."""

from moeforge.model.moe.dispatch import Dispatcher, DispatchStats, LocalDispatcher
from moeforge.model.moe.experts import GroupedExperts
from moeforge.model.moe.layer import MoELayer
from moeforge.model.moe.router import RouterOutput, TopKRouter

__all__ = [
    "DispatchStats",
    "Dispatcher",
    "GroupedExperts",
    "LocalDispatcher",
    "MoELayer",
    "RouterOutput",
    "TopKRouter",
]
