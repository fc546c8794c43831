"""LitGPT's ``GPT`` as a model family of the parallelize registry (``runtime/parallelize.py``):
``parallelize.parallelize_litgpt`` applies the layout's dimensions to it at ``fabric.setup``.
LitGPT itself is imported only by a script that uses it."""
