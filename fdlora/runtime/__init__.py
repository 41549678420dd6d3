"""What a running model needs around it: request scopes and per-model locks, per-row / per-sample routing of
adapter names, the integration session kept beside the handle, and background loads."""
