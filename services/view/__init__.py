"""`rollgym view`: a local, offline web page over rollouts, failures, tokens and training curves.

index: byte-offset index and filters over JSONL files that grow while read; runs: the runs found
under the command's paths and their summaries; tokens: token ids to text; app: the HTTP app; serve:
runs it for `rollgym view` (whose options live in rollgym.cli.view). static/ holds the page and the vendored chart library (uPlot), shipped with the package.
"""
