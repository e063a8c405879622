"""What a run needs besides the maths: atomic checkpoint files, per-step seeds, the process's malloc setting."""
