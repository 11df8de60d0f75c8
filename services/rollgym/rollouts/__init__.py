"""Collecting rollouts: the local collector, the Python RolloutClient, one attempt policy and one writer."""
