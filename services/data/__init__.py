"""From rollouts to training data: the JSONL reader, exports, curriculum selection, task preparation."""
