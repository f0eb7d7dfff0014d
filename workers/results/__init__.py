"""What a run leaves and what it may claim: the record store (one atomic write), the certificate ledger of
attempts, the paired per-item evidence a certificate is decided on, the flipped items, and the scope a
certificate covers (read by ``cluster/`` and the commands alike). Knows records and files; no Ray, no MLflow."""
