"""Collectives, bucketing, ZeRO++ quantized collectives (qwZ/qgZ/hpZ), comm logging and a multi-rank test harness."""

__version__ = "0.1.0"
