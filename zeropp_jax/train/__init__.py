"""The train state, the step, optimizer checks, accumulation, losses and checkpoints."""
