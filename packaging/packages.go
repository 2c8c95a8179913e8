package main

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/goreleaser/nfpm/v2"
	"github.com/goreleaser/nfpm/v2/files"
)

// Where the packages install things. The unit's ExecStart names hostdPath
// and shunt-run looks for the library at ../lib/<arch>-linux-gnu/shunt/
// from its own directory; the tests check both.
const (
	hostdPath     = "/usr/sbin/hostd"
	unitPath      = "/lib/systemd/system/shunt-hostd.service"
	vsockdPath    = "/usr/sbin/shunt-vsockd"
	vsockdUnit    = "/lib/systemd/system/shunt-vsockd.service"
	vstretchdPath = "/usr/sbin/shunt-vstretchd"
	vstretchdUnit = "/lib/systemd/system/shunt-vstretchd.service"
	configPath    = "/etc/shunt/hostd.hcl"
	dashboardPath = "/usr/share/shunt/grafana-dashboard.json"
	shuntRunPath  = "/usr/bin/shunt-run"
	preloadPath   = "/usr/lib/x86_64-linux-gnu/shunt/libshunt-preload.so"
	udevRulePath  = "/lib/udev/rules.d/70-shunt.rules"
	cniPath       = "/usr/lib/cni/shunt"  // where Debian's containernetworking-plugins are
	cdiPath       = "/etc/cdi/shunt.json" // read by podman, CRI-O and containerd
	containersDoc = "/usr/share/doc/shunt-host/containers.md"
)

// build says where the inputs are and what the packages are stamped with.
type build struct {
	Root       string // the repository
	Bin        string // built hostd, libshunt-preload.so and shunt-run
	Version    string // a Debian version (debVersion)
	Maintainer string
}

const homepage = "https://github.com/shuntnet/shunt"

// packages describes shunt-host and shunt-guest.
func (b build) packages() ([]*nfpm.Info, error) {
	src := func(p string) string { return filepath.Join(b.Root, p) }
	bin := func(p string) string { return filepath.Join(b.Bin, p) }
	hostLibc, err := glibcDepends(bin("hostd"))
	if err != nil {
		return nil, err
	}
	guestLibc, err := glibcDepends(bin("libshunt-preload.so"))
	if err != nil {
		return nil, err
	}

	host := b.info("shunt-host", `Shunt host daemon: shared-memory fast path for guest TCP flows
 hostd leaves TCP connection setup on the kernel stack, so the host's
 firewall, NAT and conntrack decide which connections exist, and hands each
 established, allowed flow between two VM or container guests on this host
 to shared-memory rings. The service is installed but not enabled: edit
 /etc/shunt/hostd.hcl, then run systemctl enable --now shunt-hostd.
 shunt-vsockd (a unit, not enabled) serves QEMU VMs' vsock devices so
 that they outlive hostd restarts (vsockd_socket).`)
	// hostd runs no other program: conntrack and interfaces are netlink,
	// the witness is eBPF. nftables writes the ct marks the example
	// configuration relies on (ct_mark), but another firewall can too.
	host.Depends = nonEmpty(hostLibc)
	host.Recommends = []string{"nftables"}
	host.Suggests = []string{"conntrack"}
	host.Contents = files.Contents{
		file(bin("hostd"), hostdPath, 0o755),
		file(src("hostd/dist/shunt-hostd.service"), unitPath, 0o644),
		// The QEMU VMs' vsock devices, outliving hostd (docs/vsock.md).
		file(bin("shunt-vsockd"), vsockdPath, 0o755),
		file(src("hostd/dist/shunt-vsockd.service"), vsockdUnit, 0o644),
		{Source: src("hostd/dist/hostd.hcl"), Destination: configPath, Type: files.TypeConfig,
			FileInfo: &files.ContentFileInfo{Mode: 0o600}},
		file(src("hostd/dist/grafana-dashboard.json"), dashboardPath, 0o644),
		file(src("README.md"), "/usr/share/doc/shunt-host/README.md", 0o644),
		file(src("docs/config.md"), "/usr/share/doc/shunt-host/config.md", 0o644),
		// Containers (docs/containers.md): the CNI plugin and the CDI
		// spec, whose device "default" mounts shunt-guest's library.
		file(bin("cni/shunt"), cniPath, 0o755),
		{Source: src("container/cdi/shunt.json"), Destination: cdiPath, Type: files.TypeConfig,
			FileInfo: &files.ContentFileInfo{Mode: 0o644}},
		file(src("docs/containers.md"), containersDoc, 0o644),
	}
	host.Scripts = nfpm.Scripts{
		PostInstall: src("packaging/scripts/shunt-host.postinst"),
		PreRemove:   src("packaging/scripts/shunt-host.prerm"),
		PostRemove:  src("packaging/scripts/shunt-host.postrm"),
	}

	guest := b.info("shunt-guest", `Shunt guest side: run unmodified programs on the shared-memory fast path
 shunt-run starts a program with libshunt-preload.so, which moves the TCP
 connections hostd allows to shared-memory rings and leaves all others on
 TCP. In a VM, a udev rule gives group shunt the virtio-serial control ports
 and the ivshmem region, so members of that group can use the fast path. In
 a VM without ivshmem but with virtio-vsock, shunt-vstretchd (a unit, not
 enabled) carries the flows of programs run with SHUNT_VSOCK=1 over vsock.`)
	// groupadd is in passwd.
	guest.Depends = append(nonEmpty(guestLibc), "passwd")
	guest.Contents = files.Contents{
		file(bin("shunt-run"), shuntRunPath, 0o755),
		file(bin("libshunt-preload.so"), preloadPath, 0o644),
		file(src("packaging/guest/70-shunt.rules"), udevRulePath, 0o644),
		// VMs without ivshmem: the C library's vsock stretches (docs/vsock.md).
		file(bin("shunt-vstretchd"), vstretchdPath, 0o755),
		file(src("packaging/guest/shunt-vstretchd.service"), vstretchdUnit, 0o644),
		file(src("docs/preload.md"), "/usr/share/doc/shunt-guest/preload.md", 0o644),
		// The MPI component joins this package when it exists.
	}
	guest.Scripts = nfpm.Scripts{PostInstall: src("packaging/scripts/shunt-guest.postinst")}

	for _, info := range []*nfpm.Info{host, guest} {
		for _, c := range info.Contents {
			if _, err := os.Stat(c.Source); err != nil {
				return nil, fmt.Errorf("%s: %w (run make deb, which builds bin/ first)", info.Name, err)
			}
		}
	}
	return []*nfpm.Info{host, guest}, nil
}

func (b build) info(name, description string) *nfpm.Info {
	return nfpm.WithDefaults(&nfpm.Info{
		Name:          name,
		Arch:          "amd64",
		Platform:      "linux",
		Version:       b.Version,
		VersionSchema: "none", // already a Debian version
		Section:       "net",
		Priority:      "optional",
		Maintainer:    b.Maintainer,
		Homepage:      homepage,
		Description:   description,
	})
}

func file(src, dst string, mode fs.FileMode) *files.Content {
	return &files.Content{Source: src, Destination: dst, FileInfo: &files.ContentFileInfo{Mode: mode}}
}

func nonEmpty(s ...string) []string {
	var out []string
	for _, x := range s {
		if x != "" {
			out = append(out, x)
		}
	}
	return out
}
