//go:build !linux

package cni

import "errors"

// HostPeer is Linux's only.
func HostPeer(string, string) (string, bool, error) {
	return "", false, errors.New("CNI needs Linux")
}
