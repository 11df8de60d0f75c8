"""From rollouts to training data: the JSONL reader, which agent a row goes to, exports, curriculum
selection, task preparation."""
