"""Loop forever at import."""
while True:
    pass
