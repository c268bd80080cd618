"""``moeforge bench``: named variants of one config side by side, in-process comparisons against peers, reports."""
