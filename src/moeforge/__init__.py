"""moeforge: train Mixture-of-Experts language models, from one CPU to a GPU cluster."""

__version__ = "0.1.0"
