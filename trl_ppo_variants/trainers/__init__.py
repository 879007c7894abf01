"""One file per algorithm, each holding its config and its trainer; `base.py` owns the seam into TRL."""
