"""What training provides to the audits: canaries and reference models."""
