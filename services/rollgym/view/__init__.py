"""`rollgym view`: a local, offline web page over rollouts, failures, tokens and training curves.

- index: byte-offset index and filters over JSONL files that grow while they are read;
- runs: the runs found under the command's paths, and their summaries and charts;
- rollout: what a page shows of one rollout (table row, token view) or one group;
- tokens: token ids to text with a GGUF's vocabulary;
- app: the HTTP app (the page and its JSON API); serve: runs it for `rollgym view`
  (whose options live in rollgym.cli.view);
- static/: the page and the vendored chart library (uPlot), shipped with the package.
"""
