"""``bitserve serve --workers N``: the supervisor, each worker process, the state and changes every
worker holds alike."""
