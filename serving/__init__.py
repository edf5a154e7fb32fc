"""What ships in the image beside the model repository and the backends:
the tritonserver supervisor and the Python-stub watchdog (standard library only)."""
