#!/usr/bin/env bash
# Run a command as root the way Docker's default profile leaves root in a container (Gradescope, most
# Kubernetes pods and CI runners): Docker's default capability set only (no CAP_SYS_ADMIN, so no namespaces
# can be made), and no cgroup tree (an empty /sys/fs/cgroup). Used by kit_tests/sandbox/test_container.py.
#
#   kit_tests/docker_default.sh COMMAND [ARG...]
#
# Needs root with CAP_SYS_ADMIN here (it makes a private mount namespace first, then drops the rest).
# A Python installation that lives where only root can reach it (a pyenv in /root, which is 0700) is shown
# the way an image has it, readable by every user: /root is replaced, in this namespace only, by an empty
# folder holding just that installation. Nothing outside the namespace changes. $PYTHON (default: python3)
# names the Python whose installation that is.
set -euo pipefail
capabilities=chown,dac_override,fsetid,fowner,mknod,net_raw,setgid,setuid,setfcap,setpcap,net_bind_service,sys_chroot,kill,audit_write
python_home=$("${PYTHON:-python3}" -c 'import os, sys; print(os.path.realpath(sys.base_prefix))')
exec unshare --mount --propagation private -- bash -c '
  set -euo pipefail
  mount -t tmpfs -o size=1m none /sys/fs/cgroup
  python_home=$1; capabilities=$2; shift 2
  if [[ $python_home == /root/* ]]; then
    kept=$(mktemp -d)
    mount --bind "$python_home" "$kept"
    mount -t tmpfs -o mode=755,size=1m none /root
    mkdir -p "$python_home"
    mount --move "$kept" "$python_home"
    rmdir "$kept"
  fi
  bounding=-all,$(sed "s/\([a-z_]*\)/+\1/g" <<< "$capabilities")
  exec setpriv --bounding-set "$bounding" --inh-caps -all -- "$@"
' docker-default "$python_home" "$capabilities" "$@"
