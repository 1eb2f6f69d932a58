"""The HTTP process: OpenAI API, SGLang's native /generate, health and control routes (docs/api.md).

server.build_app builds the Starlette app around an engine client (engine_client); server.run_http is
the process entry the supervisor starts.
"""
