"""A run on disk: its folder, checkpoints and their state, the export, the checks before it starts.

preflight.py   before anything loads: model, data, code and output folder reachable
folder.py      one run per folder; what a start may do with what is already there
checkpoint.py  checkpoint folders: atomic publication, manifests, pruning, resume choice
state.py       a run's state saved with DCP and loaded back for an exact resume
provenance.py  the versions and config a run ran on (provenance.json, checkpoint manifests)
peak.py        the machine's peak matmul FLOP/s: a CPU's measured and cached, a GPU's from a table
console.py     each console line once, no advertisements, the run's real stop reason
export.py      the trained policy in Hugging Face format
loggers.py     Lightning loggers behind their optional extras
curves.py      reward curves as PNG files
sweep.py       after a Hydra multirun: one table row and one curve per run
"""
