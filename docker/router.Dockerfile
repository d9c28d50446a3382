# vLLM's router (vllm-router: a Rust binary in its PyPI wheel), in front of kvxfer's prefill
# and decode engines (deploy/k8s/base/router):
#   docker build -f docker/router.Dockerfile -t vllm-router:0.1.17 docker
ARG BASE=python:3.11-slim-bookworm
# checkov:skip=CKV_DOCKER_7: BASE is a build argument whose default is a versioned tag
FROM ${BASE}
RUN python3 -m pip install --no-cache-dir "vllm-router==0.1.17" \
 && useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin router
USER 10001
EXPOSE 8000 29000
HEALTHCHECK --interval=10s --timeout=3s \
  CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)"]
ENTRYPOINT ["vllm-router"]
