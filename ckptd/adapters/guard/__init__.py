"""The dump guard: a process outside the daemon that finishes a dump's tree when the daemon
dies in the middle of it (docs/adr/0016). ``client`` is the daemon's side (the ``TreeGuard``
port), ``process`` the guard itself, ``wire`` what passes between them."""
