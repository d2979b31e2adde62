# Sourced by the scripts, from the repository root: PYTHON is what they run. An active virtual or conda
# environment's; else .venv's (setup.sh makes it when it has packages to install and no environment is active);
# else the python3 on PATH.
if [ -z "${VIRTUAL_ENV:-}${CONDA_PREFIX:-}" ] && [ -x .venv/bin/python3 ]; then
  PYTHON=.venv/bin/python3
else
  PYTHON=python3
fi
