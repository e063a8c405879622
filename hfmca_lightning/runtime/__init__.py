"""What a run needs besides the maths: files written whole (checkpoints, exports, reports), one run per checkpoint
folder, per-step seeds, the process's malloc setting."""
