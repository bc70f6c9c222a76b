"""Serving: Triton's launcher, repository, models' steps and client, replicas, Kubernetes, the OpenAI API."""
