"""The HTTP server shell: the app, its protocol limits, logs, auth, worker pools, errors, metrics, admin."""
