"""``lorafuse ui``: a web page to launch, watch, stop, resume, compare, chat with and export runs.

``app`` (the FastAPI app and the HTTP API contract), ``runs`` (detached training processes and the
queue, state on disk), ``jobs`` (merge / GGUF exports), ``chat`` (``lorafuse serve`` subprocesses),
``preview`` (dataset preview), ``estimate`` (memory and speed before launch), ``form`` (the
TrainConfig form), ``security`` (token, Host/Origin, workspace paths). ``static/`` is the page.
"""
