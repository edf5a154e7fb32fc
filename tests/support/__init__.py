"""What several test suites share to start the parts they test (not tests themselves)."""
