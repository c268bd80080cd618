"""``python -m moeforge``."""

from moeforge.cli import entry

entry()
