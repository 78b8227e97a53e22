"""Tools that are no part of the installed package: the demo model (`tools.demo`) and its trainer
(`tools/train_demo.py`, which needs torch)."""
