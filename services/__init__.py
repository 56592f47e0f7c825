"""splitstream: A/B testing, traffic recording and request replay for inference workers."""

__version__ = "0.1.0"
