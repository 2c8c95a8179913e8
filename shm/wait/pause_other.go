//go:build !amd64

package wait

func pause() {}
