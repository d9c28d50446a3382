"""The import paths operators write in engine configs. The code lives in
``kvxfer.client.integrations``; these modules only name it, and keep their names stable."""
