"""Run a command where a Soft-RoCE (rxe) device exists.

    python tools/softroce.py [options] -- COMMAND [ARGS...]
    python tools/softroce.py --host -- COMMAND      # real machine whose kernel has rdma_rxe

Guest mode (default) boots Debian's kernel under QEMU with software emulation
(TCG: this machine's KVM cannot run stock kernels), shares the host's `/`
read-only over virtio-9p with a writable tmpfs overlay on top, loads rdma_rxe,
creates rxe0 on a dummy netdev (192.0.2.1/24, documentation range; the guest has
no NIC, nothing leaves it), then runs COMMAND in the same working directory
with the same environment (so the same venv), streams its output and exits
with its exit code. It powers the guest off afterwards; `--timeout` bounds the
whole run. Host mode only creates rxe0 on a dummy netdev and runs COMMAND.

Needs (installed by tools/setup.sh --softroce): qemu-system-x86, linux-image-amd64,
busybox-static, rdma-core, ibverbs-utils. Facts and timings: ../shared/FACTS.md.
"""
from __future__ import annotations

import argparse
import glob
import gzip
import io
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

GUEST_IP = "192.0.2.1/24"
# rxe takes its path MTU from the netdev: 1500 -> 1024-byte packets, 9000 -> 4096.
MODULES_EARLY = ["virtio_pci", "9pnet_virtio", "9p", "overlay"]
RDMA_MODULES = ["rdma_rxe", "ib_uverbs", "rdma_ucm"]


class HarnessError(Exception):
    """The harness itself could not run (missing package, no kernel, ...)."""


def newest_kernel() -> tuple[str, str]:
    kernels = sorted(glob.glob("/boot/vmlinuz-*"))
    for path in reversed(kernels):
        kver = path.split("vmlinuz-", 1)[1]
        if os.path.exists(f"/lib/modules/{kver}/kernel/drivers/infiniband/sw/rxe"):
            return path, kver
    raise HarnessError("no kernel with rdma_rxe in /boot and /lib/modules "
                       "(apt-get install linux-image-amd64)")


def module_paths(kver: str, names: list[str]) -> list[str]:
    """The .ko files for names, dependencies first, each once."""
    out: list[str] = []
    for name in names:
        r = subprocess.run(["modprobe", "-S", kver, "--show-depends", name],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise HarnessError(f"modprobe cannot resolve {name} for {kver}: {r.stderr.strip()}")
        for line in r.stdout.splitlines():
            parts = line.split()
            if parts and parts[0] == "insmod" and parts[1] not in out:
                out.append(parts[1])
    return out


def cpio_newc(entries: list[tuple[str, int, bytes]]) -> bytes:
    """A newc cpio archive of (name, mode, data) entries."""
    buf = io.BytesIO()
    ino = 1
    for name, mode, data in entries + [("TRAILER!!!", 0, b"")]:
        nb = name.encode() + b"\0"
        hdr = "070701" + "".join(f"{v:08x}" for v in (
            ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(nb), 0))
        buf.write(hdr.encode() + nb)
        buf.write(b"\0" * ((4 - (110 + len(nb)) % 4) % 4))
        buf.write(data)
        buf.write(b"\0" * ((4 - len(data) % 4) % 4))
        ino += 1
    return buf.getvalue()


INIT = r"""#!/bin/busybox sh
# Stage 1 (initramfs): mount the host's / read-only over 9p with a tmpfs
# overlay, then hand over to stage 2 inside it.
/bin/busybox mkdir -p /proc /sys /dev /lower /rw /newroot
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sys /sys
/bin/busybox mount -t devtmpfs dev /dev
for m in $(cat /modules); do /bin/busybox insmod "$m" || echo "insmod $m failed"; done
/bin/busybox mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=262144 hostroot /lower || exec /bin/busybox sh -c 'echo "stage1: cannot mount the host root"; echo o > /proc/sysrq-trigger'
/bin/busybox mount -t tmpfs -o size=1g tmpfs /rw
/bin/busybox mkdir -p /rw/upper /rw/work
/bin/busybox mount -t overlay overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work /newroot
/bin/busybox mkdir -p /newroot/run/fabric-job
/bin/busybox mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 job /newroot/run/fabric-job
/bin/busybox umount /proc /sys /dev 2>/dev/null
exec /bin/busybox switch_root /newroot /bin/sh /run/fabric-job/stage2.sh
"""

STAGE2 = r"""#!/bin/sh
# Stage 2 (the host's filesystem, overlaid): rxe0, then the command.
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev 2>/dev/null
mkdir -p /dev/pts /dev/shm; mount -t devpts devpts /dev/pts; mount -t tmpfs tmpfs /dev/shm
# (no tmpfs on /tmp: the working directory may live there; the overlay is writable)
J=/run/fabric-job
finish() { echo "$1" > $J/exit; sync; echo o > /proc/sysrq-trigger; sleep 30; }
for m in {rdma_modules}; do modprobe "$m" || { echo "softroce: modprobe $m failed" >> $J/output; finish 97; }; done
ip link set lo up
ip link add sr0 type dummy && ip link set sr0 mtu {mtu} && ip addr add {guest_ip} dev sr0 && ip link set sr0 up || finish 97
rdma link add rxe0 type rxe netdev sr0 || { echo "softroce: rdma link add failed" >> $J/output; finish 97; }
i=0
while [ "$(cat /sys/class/infiniband/rxe0/ports/1/state 2>/dev/null)" != "4: ACTIVE" ]; do
    i=$((i+1)); [ $i -gt 200 ] && { echo "softroce: rxe0 never became ACTIVE" >> $J/output; finish 97; }
    sleep 0.05
done
echo "softroce: rxe0 ACTIVE on sr0 ($(uname -r))" >> $J/output
. $J/env.sh
export FABRIC_IN_SOFTROCE_GUEST=1
cd {cwd} || finish 98
{command} >> $J/output 2>&1
finish $?
"""


def build_initramfs(kver: str, cache_dir: str) -> str:
    path = os.path.join(cache_dir, f"initramfs-{kver}.cpio.gz")
    if os.path.exists(path):
        return path
    busybox = shutil.which("busybox") or "/bin/busybox"
    with open(busybox, "rb") as f:
        bb = f.read()
    if b"GLIBC" in bb[:4096] and not os.path.exists("/usr/share/doc/busybox-static"):
        raise HarnessError("busybox must be static (apt-get install busybox-static)")
    entries = [("bin", 0o40755, b""), ("bin/busybox", 0o100755, bb), ("init", 0o100755, INIT.encode())]
    mods = module_paths(kver, MODULES_EARLY)
    names = []
    entries.append(("lib", 0o40755, b""))
    for i, m in enumerate(mods):
        name = f"lib/{i:02d}-{os.path.basename(m)}"
        with open(m, "rb") as f:
            data = f.read()
        if m.endswith(".xz") or m.endswith(".zst"):
            raise HarnessError(f"compressed module {m}: not supported")
        entries.append((name, 0o100644, data))
        names.append("/" + name)
    entries.append(("modules", 0o100644, "\n".join(names).encode() + b"\n"))
    os.makedirs(cache_dir, exist_ok=True)
    tmp = path + ".tmp"
    with gzip.open(tmp, "wb", compresslevel=1) as f:
        f.write(cpio_newc(entries))
    os.replace(tmp, path)
    return path


def run_guest(command: list[str], timeout: float, memory: int, cpus: int, verbose: bool,
              mtu: int = 9000) -> int:
    qemu = shutil.which("qemu-system-x86_64")
    if qemu is None:
        raise HarnessError("qemu-system-x86_64 is missing (apt-get install qemu-system-x86)")
    kernel, kver = newest_kernel()
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "fabric", "softroce")
    initrd = build_initramfs(kver, cache)
    job = tempfile.mkdtemp(prefix="softroce-")
    try:
        env_lines = []
        for k, v in os.environ.items():
            if k.isidentifier() and not k.startswith(("BASH_FUNC",)) and k not in ("PWD", "OLDPWD", "SHLVL", "_"):
                env_lines.append(f"export {k}={shlex.quote(v)}")
        with open(os.path.join(job, "env.sh"), "w") as f:
            f.write("\n".join(env_lines) + "\n")
        with open(os.path.join(job, "stage2.sh"), "w") as f:
            f.write(STAGE2.replace("{rdma_modules}", " ".join(RDMA_MODULES))
                    .replace("{guest_ip}", GUEST_IP)
                    .replace("{mtu}", str(mtu))
                    .replace("{cwd}", shlex.quote(os.getcwd()))
                    .replace("{command}", " ".join(shlex.quote(c) for c in command)))
        open(os.path.join(job, "output"), "w").close()
        serial = os.path.join(job, "serial.log")
        # -cpu max: the default qemu64 model lacks SSE4.2 and friends, which
        # numpy (x86-64-v2 baseline) needs; TCG emulates them.
        cmd = [qemu, "-accel", "tcg,thread=multi", "-cpu", "max", "-smp", str(cpus), "-m", str(memory),
               "-kernel", kernel, "-initrd", initrd,
               "-append", "console=ttyS0 panic=-1 rdinit=/init loglevel=4",
               "-display", "none", "-serial", f"file:{serial}", "-monitor", "none",
               "-no-reboot", "-nic", "none",
               "-fsdev", "local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap",
               "-device", "virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot",
               "-fsdev", f"local,id=job,path={job},security_model=none,multidevs=remap",
               "-device", "virtio-9p-pci,fsdev=job,mount_tag=job"]
        started = time.monotonic()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        pos = 0
        code = None
        out_path = os.path.join(job, "output")
        exit_path = os.path.join(job, "exit")
        while True:
            with open(out_path, "rb") as f:
                f.seek(pos)
                chunk = f.read()
            if chunk:
                pos += len(chunk)
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
            if os.path.exists(exit_path):
                text = open(exit_path).read().strip()
                if text:
                    code = int(text)
            if proc.poll() is not None:
                break
            if time.monotonic() - started > timeout:
                print(f"softroce: timed out after {timeout:.0f} s; stopping the guest", file=sys.stderr)
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                code = 124
                break
            time.sleep(0.2)
        with open(out_path, "rb") as f:
            f.seek(pos)
            sys.stdout.buffer.write(f.read())
            sys.stdout.flush()
        if code is None and os.path.exists(exit_path):
            text = open(exit_path).read().strip()
            code = int(text) if text else None
        if code is None:
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            tail = open(serial, errors="replace").read()[-3000:] if os.path.exists(serial) else ""
            print(f"softroce: the guest stopped without an exit code.\nqemu: {err}\nserial:\n{tail}",
                  file=sys.stderr)
            return 99
        if verbose:
            print(f"softroce: guest done in {time.monotonic() - started:.1f} s, exit {code}", file=sys.stderr)
        return code
    finally:
        shutil.rmtree(job, ignore_errors=True)


def run_host(command: list[str], timeout: float) -> int:
    """On a machine whose kernel has rdma_rxe: rxe0 on a dummy netdev, then the command."""
    if not os.path.exists("/sys/module/rdma_rxe") and subprocess.run(["modprobe", "rdma_rxe"]).returncode != 0:
        raise HarnessError("this kernel has no rdma_rxe module; use guest mode (the default)")
    subprocess.run(["modprobe", "ib_uverbs"])
    if not os.path.exists("/sys/class/infiniband/rxe0"):
        subprocess.run(["ip", "link", "add", "sr0", "type", "dummy"], check=False)
        subprocess.run(["ip", "addr", "add", GUEST_IP, "dev", "sr0"], check=False)
        subprocess.run(["ip", "link", "set", "sr0", "up"], check=True)
        subprocess.run(["rdma", "link", "add", "rxe0", "type", "rxe", "netdev", "sr0"], check=True)
    return subprocess.run(command, timeout=timeout).returncode


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", action="store_true", help="set up rxe on this machine instead of a guest")
    ap.add_argument("--timeout", type=float, default=900, help="seconds for the whole run (default 900)")
    ap.add_argument("--memory", type=int, default=2048, help="guest memory in MiB")
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--mtu", type=int, default=9000,
                    help="MTU of the dummy netdev under rxe0 (9000 gives rxe a 4096-byte path MTU)")
    ap.add_argument("--check", action="store_true", help="only say whether the harness can run here")
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("command", nargs="*")
    args = ap.parse_args(argv)
    try:
        if args.check:
            if args.host:
                ok = os.path.exists("/sys/module/rdma_rxe")
                print("host rdma_rxe: " + ("yes" if ok else "no"))
                return 0 if ok else 1
            newest_kernel()
            if shutil.which("qemu-system-x86_64") is None:
                raise HarnessError("qemu-system-x86_64 is missing (apt-get install qemu-system-x86)")
            print("softroce guest: ready")
            return 0
        if not args.command:
            ap.error("give a command after --")
        if args.host:
            return run_host(args.command, args.timeout)
        return run_guest(args.command, args.timeout, args.memory, args.cpus, args.verbose, args.mtu)
    except HarnessError as e:
        print(f"softroce: {e}", file=sys.stderr)
        return 96


if __name__ == "__main__":
    sys.exit(main())
