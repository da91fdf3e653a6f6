"""raycheckpoint for verl jobs: reading the checkpoints verl's own manager wrote."""
