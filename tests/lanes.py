"""CI's 30 minutes: slow tests that run in the nightly lane only.

`make test` (CI) runs the fast lane and the tests marked `slow` but not `nightly`; `make
test-nightly` runs the `nightly` ones. The tests below are slow-lane tests that took 40 s or more
each on the 2-core host (`pytest -m "slow and not nightly" -n 2 --durations=0`, 2026-11-29: the
times beside them, measured with other work running). `conftest.py` marks them `nightly` when
collected, so their files keep one marker per test. What CI keeps of each kind: one 2-rank
DDP gradient test (with text and image rows) and one FSDP2 gradient test, a killed vLLM server, the
demo's runs/demo commands, and every multi-process, fault and server test under 40 s.
`tests/test_lanes.py` checks that every id here is still a test.
"""

NIGHTLY_ONLY = frozenset(
    {
        # tests/test_checkpoint.py
        "tests/test_checkpoint.py::test_a_full_disk_at_a_checkpoint_stops_with_one_message_and_keeps_the_earlier_ones",  # 63 s
        "tests/test_checkpoint.py::test_a_kill_during_a_save_leaves_the_previous_checkpoint_usable",  # 89 s
        "tests/test_checkpoint.py::test_a_resume_from_the_checkpoint_at_an_epoch_end_trains_on_to_max_steps",  # 77 s
        "tests/test_checkpoint.py::test_an_async_run_resumes_after_sigkill",  # 48 s
        "tests/test_checkpoint.py::test_resume_refuses_a_trainer_state_that_needs_unpickling_without_running_it",  # 57 s
        "tests/test_checkpoint.py::test_resume_with_nothing_left_to_train_says_so",  # 67 s
        # tests/test_clean_exit.py
        "tests/test_clean_exit.py::test_a_run_that_stops_mid_generation_ends_at_once_and_cleanly",  # 138 s
        # tests/test_cluster_rehearsal.py
        "tests/test_cluster_rehearsal.py::test_the_short_rehearsal_trains_across_two_nodes_and_survives_a_killed_trainer",  # 200 s
        # tests/test_cookbook.py
        "tests/test_cookbook.py::test_cookbook_style_examples_train_and_their_reward_rises[cookbook_message_in-0.2]",  # 44 s
        "tests/test_cookbook.py::test_cookbook_style_examples_train_and_their_reward_rises[cookbook_token_in-0.4]",  # 43 s
        # tests/test_curriculum.py
        "tests/test_curriculum.py::test_two_ranks_draw_disjoint_rows_and_hold_the_same_merged_statistics",  # 54 s
        # tests/test_ddp.py
        "tests/test_ddp.py::test_a_killed_ddp_run_resumes_bit_identical",  # 146 s
        "tests/test_ddp.py::test_a_two_rank_lora_run_resumes_bit_identical",  # 109 s
        "tests/test_ddp.py::test_both_ranks_step_when_either_has_a_signal_and_skip_together_when_neither_has",  # 44 s
        "tests/test_ddp.py::test_ranks_sample_disjoint_rows_that_together_are_a_single_process_run_with_twice_the_groups",  # 75 s
        "tests/test_ddp.py::test_two_process_gradient_with_images_equals_one_process_gradient_on_the_union[plain]",  # 71 s
        # tests/test_env_servers.py
        "tests/test_env_servers.py::test_a_greedy_calculator_episode_on_a_server_is_the_hf_samplers_token_by_token",  # 62 s
        "tests/test_env_servers.py::test_greedy_lookup_episodes_and_their_information_gains_on_a_server_are_the_hf_samplers",  # 59 s
        # tests/test_fsdp2.py
        "tests/test_fsdp2.py::test_a_killed_fsdp2_run_resumes_bit_identical_and_every_sync_hands_the_sampler_full_weights",  # 174 s
        "tests/test_fsdp2.py::test_lora_under_fsdp2_trains_its_adapters_only[adapter]",  # 50 s
        "tests/test_fsdp2.py::test_lora_under_fsdp2_trains_its_adapters_only[merged]",  # 56 s
        "tests/test_fsdp2.py::test_sharded_gradient_equals_one_process_gradient_on_the_union[token_budget]",  # 76 s
        "tests/test_fsdp2.py::test_sharded_gradient_equals_one_process_gradient_on_the_union[uneven]",  # 67 s
        "tests/test_fsdp2.py::test_sharded_gradient_with_images_equals_one_process_gradient_on_the_union[train_vision]",  # 75 s
        "tests/test_fsdp2.py::test_sharded_gradient_with_images_equals_one_process_gradient_on_the_union[uneven]",  # 74 s
        "tests/test_fsdp2.py::test_sharded_training_ends_with_the_weights_of_one_process_on_the_union",  # 66 s
        # tests/test_fused_head.py
        "tests/test_fused_head.py::test_every_policy_loss_trains_the_same_with_the_fused_head_on_and_off",  # 53 s
        # tests/test_gguf.py
        "tests/test_gguf.py::test_a_run_of_a_built_hub_id_checkpoints_the_name_as_given_and_resumes",  # 43 s
        # tests/test_gpu_check.py
        "tests/test_gpu_check.py::test_the_gpu_check_dry_run_trains_every_variant_and_reports_each_measure",  # 150 s
        # tests/test_gradient_checkpointing.py
        "tests/test_gradient_checkpointing.py::test_a_2_process_checkpointed_step_has_the_gradient_of_one_process_without_it[ddp]",  # 80 s
        "tests/test_gradient_checkpointing.py::test_a_2_process_checkpointed_step_has_the_gradient_of_one_process_without_it[fsdp2]",  # 95 s
        # tests/test_health.py
        "tests/test_health.py::test_two_ranks_log_the_metrics_of_one_process_on_the_union",  # 57 s
        # tests/test_judge_example.py
        "tests/test_judge_example.py::test_a_run_weighs_the_judge_beside_exact_match",  # 44 s
        "tests/test_judge_example.py::test_the_judge_grades_completions_concurrently_under_the_limit",  # 54 s
        # tests/test_lora.py
        "tests/test_lora.py::test_lora_run_resumes_exactly_and_its_checkpoint_exports",  # 97 s
        # tests/test_lora_sync.py
        "tests/test_lora_sync.py::test_a_lora_run_syncs_its_adapter_to_the_servers_it_starts",  # 130 s
        "tests/test_lora_sync.py::test_after_each_adapter_sync_the_served_logprobs_are_the_lora_policys",  # 60 s
        "tests/test_lora_sync.py::test_one_server_pool_serves_run_after_run_and_a_preempted_run_resumes_on_it",  # 166 s
        # tests/test_menu.py
        "tests/test_menu.py::test_one_multirun_runs_every_choice_and_writes_the_sweep_table",  # 170 s
        # tests/test_moving_reference.py
        "tests/test_moving_reference.py::test_a_run_with_a_moving_reference_resumes_bit_identical",  # 70 s
        "tests/test_moving_reference.py::test_a_two_rank_run_with_a_moving_reference_resumes_bit_identical[ddp]",  # 130 s
        "tests/test_moving_reference.py::test_a_two_rank_run_with_a_moving_reference_resumes_bit_identical[fsdp2]",  # 136 s
        # tests/test_packaging.py
        "tests/test_packaging.py::test_a_users_config_dir_adds_experiments",  # 57 s
        # tests/test_peer_faults.py
        "tests/test_peer_faults.py::test_a_frozen_rank_is_found_by_its_silence",  # 50 s
        "tests/test_peer_faults.py::test_a_killed_rank_1_stops_rank_0_with_its_name_and_the_run_resumes[ddp-checkpoint]",  # 100 s
        "tests/test_peer_faults.py::test_a_killed_rank_1_stops_rank_0_with_its_name_and_the_run_resumes[fsdp2-training]",  # 95 s
        # tests/test_rehearsal.py
        "tests/test_rehearsal.py::test_the_rehearsal_trains_checkpoints_and_resumes_at_the_real_vocabulary",  # 87 s
        # tests/test_reward_model.py
        "tests/test_reward_model.py::test_vllm_serves_the_reward_model_with_the_same_scores",  # 89 s
        # tests/test_sampler_vllm_server.py
        "tests/test_sampler_vllm_server.py::test_an_asynchronous_run_with_partial_rollouts_attached_to_the_servers",  # 42 s
        "tests/test_sampler_vllm_server.py::test_served_logprobs_equal_the_trainers_before_and_after_syncs_on_both_replicas",  # 97 s
        "tests/test_sampler_vllm_server.py::test_two_ddp_ranks_each_sync_their_own_server_with_the_same_weights",  # 53 s
        # tests/test_server_faults.py
        "tests/test_server_faults.py::test_a_server_lost_in_a_sync_saves_the_trained_step_and_resume_continues",  # 89 s
        "tests/test_server_faults.py::test_a_server_lost_while_sampling_names_the_server_and_the_step_to_resume_from",  # 68 s
        "tests/test_server_faults.py::test_real_servers_killed_in_a_sync_and_while_sampling",  # 267 s
        # tests/test_server_keys.py
        "tests/test_server_keys.py::test_a_run_with_the_key_trains_and_a_wrong_key_stops_it_naming_the_server",  # 53 s
        "tests/test_server_keys.py::test_every_route_but_health_needs_the_key",  # 52 s
        # tests/test_signals.py
        "tests/test_signals.py::test_a_signal_during_a_hung_rollout_stops_within_seconds[SIGTERM-143-offpolicy.synchronous=true]",  # 54 s
        "tests/test_signals.py::test_sigterm_during_a_step_checkpoints_that_step_and_resumes_exactly",  # 89 s
        # tests/test_step_sequence.py
        "tests/test_step_sequence.py::test_every_mode_finishes_with_no_callbacks[async-O1-O2]",  # 46 s
        "tests/test_step_sequence.py::test_every_mode_finishes_with_no_callbacks[sync]",  # 44 s
        # tests/test_train.py
        "tests/test_train.py::test_a_short_run_raises_the_reward",  # 44 s
        "tests/test_train.py::test_policy_loss_multirun_writes_a_sweep_summary",  # 54 s
        # tests/test_vlm.py
        "tests/test_vlm.py::test_a_killed_vlm_run_resumes_bit_identical_and_exports_its_processor",  # 81 s
        # tests/test_vlm_vllm.py
        "tests/test_vlm_vllm.py::test_the_tiny_idefics3_prompt_keeps_its_template_and_images[vllm_server]",  # 54 s
        # tests/test_weights.py
        "tests/test_weights.py::test_sharded_policy_gathers_to_the_unsharded_state_on_both_ranks[dtensor]",  # 43 s
        "tests/test_weights.py::test_sharded_policy_gathers_to_the_unsharded_state_on_both_ranks[fsdp2]",  # 44 s
    }
)
