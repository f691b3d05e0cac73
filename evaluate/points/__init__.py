"""Spec: a composed configuration checked, typed and resolved once into what each point runs (its press, name,
fingerprint, run directory), then planned with its samples before any model loads."""
