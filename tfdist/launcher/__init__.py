"""Starting jobs: `launch` runs every task of a job (on this machine or over SSH), `hosts` parses
host lists and hostfiles, `ssh` starts remote tasks, `tfjob` writes Kubeflow TFJob manifests, `threads`
splits a machine's cores between its tasks."""
