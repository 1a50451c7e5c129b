"""The experiment queue: ``nanolab queue add/ls/rm/retry/clear/run``.

Jobs live in a SQLite database in the project directory (``nanolab_queue.db``), so several
shells can add jobs while a runner works through them, and nothing is lost when the runner or
the machine dies. Each job is a ``nanolab fit`` subprocess with a fixed run name, so a job that
was interrupted resumes from its checkpoint instead of starting over.

Modules: :mod:`~nanolab.queue.db` (the database: schema, atomic claims, runner liveness),
:mod:`~nanolab.queue.jobs` (turning ``queue add`` arguments into validated jobs),
:mod:`~nanolab.queue.predict` (how long a job will take), :mod:`~nanolab.queue.runner` (one job
per GPU, restarts, deadlines) and :mod:`~nanolab.queue.cli` (the command line).
"""
