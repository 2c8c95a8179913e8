// Package cdi makes the CDI spec (Container Device Interface, read by
// podman, CRI-O and containerd) that puts a container on Shunt when it
// asks for a device of kind shunt.net/guest (docs/containers.md):
//
//   - shunt.net/guest=default: hostd's container socket directory, the
//     preload library, LD_PRELOAD and SHUNT_CONTROL, for any program of a
//     glibc image;
//   - shunt.net/guest=socket: the socket directory and SHUNT_CONTROL only,
//     for Go programs (guestlib) and images whose libc cannot load the
//     host's library.
//
// The directory is mounted, not the socket: a restarted hostd makes a new
// socket file, which a bind mount of the old one would never see.
package cdi

import (
	"encoding/json"
	"fmt"
	"path/filepath"
)

// Kind is the CDI device kind of a Shunt guest.
const Kind = "shunt.net/guest"

// Version is the CDI spec version written: 0.5.0, which podman 4.3 and
// later, CRI-O and containerd read.
const Version = "0.5.0"

// Defaults: where the packages put hostd's container socket and the
// preload library, and where a container finds the library.
const (
	DefaultSocket       = "/run/shunt/container/control.sock"
	DefaultLibrary      = "/usr/lib/x86_64-linux-gnu/shunt/libshunt-preload.so"
	ContainerLibraryDir = "/usr/lib/shunt"
)

// Spec is a CDI spec, as much of it as Shunt writes.
type Spec struct {
	CDIVersion string   `json:"cdiVersion"`
	Kind       string   `json:"kind"`
	Devices    []Device `json:"devices"`
}

// Device is one named device and its edits.
type Device struct {
	Name           string `json:"name"`
	ContainerEdits Edits  `json:"containerEdits"`
}

// Edits are what a device changes in a container.
type Edits struct {
	Env    []string `json:"env,omitempty"`
	Mounts []Mount  `json:"mounts,omitempty"`
}

// Mount is a bind mount into the container.
type Mount struct {
	HostPath      string   `json:"hostPath"`
	ContainerPath string   `json:"containerPath"`
	Options       []string `json:"options,omitempty"`
}

// Make returns the spec for hostd's container socket at socket (its
// directory must hold nothing else: it is mounted whole) and the preload
// library at lib.
func Make(socket, lib string) (Spec, error) {
	if !filepath.IsAbs(socket) || !filepath.IsAbs(lib) {
		return Spec{}, fmt.Errorf("cdi: want absolute paths, not %q and %q", socket, lib)
	}
	dir := filepath.Dir(socket)
	if dir == "/" || dir == "/run" || dir == "/run/shunt" {
		return Spec{}, fmt.Errorf("cdi: container_socket %s: give it a directory of its own (such as %s), which is mounted into containers whole; %s holds more",
			socket, filepath.Dir(DefaultSocket), dir)
	}
	sock := Mount{HostPath: dir, ContainerPath: dir, Options: []string{"rbind", "rw"}}
	inLib := filepath.Join(ContainerLibraryDir, filepath.Base(lib))
	return Spec{CDIVersion: Version, Kind: Kind, Devices: []Device{
		{Name: "default", ContainerEdits: Edits{
			Env: []string{"SHUNT_CONTROL=" + socket, "LD_PRELOAD=" + inLib},
			Mounts: []Mount{sock,
				{HostPath: lib, ContainerPath: inLib, Options: []string{"ro", "bind"}}},
		}},
		{Name: "socket", ContainerEdits: Edits{
			Env:    []string{"SHUNT_CONTROL=" + socket},
			Mounts: []Mount{sock},
		}},
	}}, nil
}

// JSON is the spec as a CDI spec file holds it.
func (s Spec) JSON() ([]byte, error) {
	b, err := json.MarshalIndent(s, "", "  ")
	if err != nil {
		return nil, err
	}
	return append(b, '\n'), nil
}
